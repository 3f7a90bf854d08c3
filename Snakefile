# align: gated, pre-registered DPO. The chain per arm:
# sft -> sft_gate -> build_manifest -> ref_cache -> dpo. See DESIGN in README.
import os

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


validate(
    config, os.path.join(workflow.basedir, "config", "schema", "config.schema.yaml")
)


include: "rules/common.smk"
include: "rules/tiny.smk"
include: "rules/sft.smk"
include: "rules/data.smk"
include: "rules/kernels.smk"
include: "rules/ref.smk"
include: "rules/dpo.smk"
include: "rules/select.smk"


report: "report/workflow.rst"


rule gates:
    """Every gate up to and including the probe, for every arm; nothing trains."""
    input:
        [PATHS.arm(arm).probe for arm in ARMS],


rule arms:
    input:
        [PATHS.arm(arm).arm_result for arm in ARMS],
        PATHS.selection,


rule all:
    default_target: True
    input:
        rules.arms.input,
        rules.report_figures.output,


# Cheap bookkeeping runs on the submit host rather than as cluster jobs.
localrules:
    build_manifest,
    preflight,
    report_figures,
    gates,
    arms,
    all,
