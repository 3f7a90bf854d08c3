"""Rendering and tokenization of pairs under the pre-registered truncation policy.

The prompt is rendered by the checkpoint's chat template when it has one
(messages = [system?, user], add_generation_prompt=True, then any response prefix)
and by the plain join `render_prompt` otherwise. Its tokens start with exactly one
bos: the template's own when it renders one, else one added here. Each response
follows as its tokens + eos, and labels cover response tokens only.

Policy `prompt_left_response_right`: when too long, the prompt loses tokens from
the left (bos kept, at most down to half of seq_len), then each response is cut
from the right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from align.data.chat_template import ChatTemplate, ChatTemplateError
from align.data.formats import Message, PreferenceRecord
from align.exit_codes import BadInputData


def render_prompt(prompt: str) -> str:
    """Plain prompt/response join for checkpoints without a chat template."""
    return prompt.rstrip() + "\n"


def merged_system(messages: Sequence[Message]) -> tuple[Message, ...]:
    """A leading system turn folded into the first user turn, for templates that refuse one."""
    if len(messages) >= 2 and messages[0][0] == "system" and messages[1][0] == "user":
        system, user = messages[0][1], messages[1][1]
        return (("user", f"{system}\n\n{user}"), *messages[2:])
    return tuple(messages)


class PromptRenderer:
    """How one checkpoint turns a record's prompt into token ids."""

    def __init__(
        self,
        tokenizer,
        *,
        merge_system_into_user: bool = False,
        where: str = "the checkpoint's chat template",
    ):
        self.tokenizer = tokenizer
        self.merge_system_into_user = merge_system_into_user
        self.where = where
        source = tokenizer.chat_template
        self.template = ChatTemplate(source, tokenizer.special_tokens(), where) if source else None

    @property
    def kind(self) -> str:
        return "chat_template" if self.template is not None else "plain"

    def text(self, record: PreferenceRecord) -> str:
        """The prompt text, up to where the response starts."""
        if self.template is None:
            return render_prompt(record.prompt)
        messages = record.prompt_messages()
        if self.merge_system_into_user:
            messages = merged_system(messages)
        try:
            rendered = self.template.render(
                [{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True,
            )
        except ChatTemplateError as err:
            raise BadInputData(
                f"{record.where()}: {self.where} refused the row ({err}); {self._remedy(messages)}"
            ) from err
        return rendered + record.response_prefix

    def _remedy(self, messages: Sequence[Message]) -> str:
        """What the pre-registration can change, for a row the template refused."""
        roles = [role for role, _ in messages]
        if "system" in roles and not self.merge_system_into_user:
            return (
                "the row has a system turn: set data.merge_system_into_user = true in the "
                "arm's pre-registration to fold it into the user turn"
            )
        setting = str(self.merge_system_into_user).lower()
        return f"the template was given the roles {roles} (data.merge_system_into_user = {setting})"

    def ids(
        self, records: Sequence[PreferenceRecord], texts: Sequence[str] | None = None
    ) -> list[list[int]]:
        """Prompt token ids of each record, starting with exactly one bos; `texts` are the
        records' `text`, where the caller rendered them already."""
        bos = self.tokenizer.bos_id
        texts = [self.text(r) for r in records] if texts is None else texts
        encoded = self.tokenizer.encode_batch(list(texts))
        if self.template is None:
            return [[bos, *ids] for ids in encoded]
        # The bos token's text in a rendered template encodes to the bos id itself.
        return [ids if ids[:1] == [bos] else [bos, *ids] for ids in encoded]


@dataclass(frozen=True)
class TokenizedPair:
    """Prompt and responses after truncation; `prompt_tokens` counts the prompt before it."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated: bool
    prompt_tokens: int | None = None


def truncate_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int
) -> tuple[list[int], list[int], list[int], bool]:
    """Apply `prompt_left_response_right` so prompt + each response fits in seq_len."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected, False
    budget = min(len(prompt), max(seq_len - longest, seq_len // 2))
    prompt = prompt[:1] + prompt[len(prompt) - (budget - 1) :] if budget > 1 else prompt[:1]
    room = seq_len - len(prompt)
    return prompt, chosen[:room], rejected[:room], True


def tokenize_pairs(
    records: Sequence[PreferenceRecord],
    tokenizer,
    seq_len: int,
    renderer: PromptRenderer | None = None,
    prompt_texts: Sequence[str] | None = None,
) -> list[TokenizedPair]:
    """Tokenize a batch of records (one batched encode call per field)."""
    renderer = renderer or PromptRenderer(tokenizer)
    prompts = renderer.ids(records, prompt_texts)
    chosens = tokenizer.encode_batch([r.chosen for r in records])
    rejecteds = tokenizer.encode_batch([r.rejected for r in records])
    eos = tokenizer.eos_id
    out = []
    for p, c, r in zip(prompts, chosens, rejecteds, strict=True):
        cut = truncate_pair(p, [*c, eos], [*r, eos], seq_len)
        out.append(TokenizedPair(*cut, prompt_tokens=len(p)))
    return out


def tokenize_sft(
    prompts: Sequence[str],
    responses: Sequence[str],
    tokenizer,
    seq_len: int,
    texts: Sequence[str] | None = None,
):
    """SFT rows as (ids, prompt_len) with the response cut from the right to fit seq_len;
    `texts` are the prompts as rendered already, where the caller rendered them."""
    renderer = PromptRenderer(tokenizer)
    records = [PreferenceRecord(p, "", "", "sft", i) for i, p in enumerate(prompts, start=1)]
    p_ids = renderer.ids(records, texts)
    r_ids = tokenizer.encode_batch(list(responses))
    rows = []
    for p, r in zip(p_ids, r_ids, strict=True):
        prompt, response, _, _ = truncate_pair(p, [*r, tokenizer.eos_id], [], seq_len)
        rows.append(([*prompt, *response], len(prompt)))
    return rows
