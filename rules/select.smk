# Section 13: paired evaluation of every policy and the pre-registered arm
# selection, then the report's figures (snakemake --report report.html).


rule select_arms:
    """Score every policy on one held-out set; paired statistics; the pre-registered rule."""
    input:
        script=SCRIPTS / "select_arms.py",
        gate=PATHS.sft_gate,
        manifest=PATHS.manifest,
        results=[PATHS.arm(arm).arm_result for arm in ARMS],
        config=SELECTION_TOML,
        arms=[arm_toml(arm) for arm in ARMS],
    output:
        selection=report(
            PATHS.selection,
            caption="../report/selection.rst",
            category="Selection",
            labels=lambda wildcards, output: selection_labels(output.selection),
        ),
        eval_set=SelectionPaths.of(PATHS).eval_set,
    log:
        PATHS.log("select_arms"),
    benchmark:
        PATHS.benchmark("select_arms")
    container:
        CONTAINER
    threads: config["threads"]
    resources:
        **placement(selection_layout),
        mem_mb=projected_mem_mb(
            "select_arms",
            selection_cfg_of,
            selection_layout,
            sft_checkpoint(),
            selection_shards_of,
            seq_len=lambda: selection_seq_len([arm_cfg(arm) for arm in ARMS]),
        ),
        runtime=default_runtime,
    params:
        run=RUN_OVERRIDES,
    shell:
        "python {input.script} {input.config} {input.arms} {params.run}"
        " --run.threads={threads} > {log} 2>&1"


rule report_figures:
    """The report's figures and summary tables, drawn from every receipt of the run."""
    input:
        selection=PATHS.selection,
        gate=PATHS.sft_gate,
        results=[PATHS.arm(arm).arm_result for arm in ARMS],
        probes=[PATHS.arm(arm).probe for arm in ARMS],
    output:
        training=arm_report_figures("training", "training.rst", "training curves"),
        tripwires=arm_report_figures("tripwires", "tripwires.rst", "tripwire signals"),
        probe=arm_report_figures("probe", "probe.rst", "probe step times"),
        held_out=report(
            REPORT.run_figure("held_out"),
            caption="../report/held_out.rst",
            category="Held-out accuracy",
        ),
        paired=report(
            REPORT.run_figure("paired"),
            caption="../report/paired.rst",
            category="Selection",
        ),
        summary=report(
            REPORT.summary_html, caption="../report/summary.rst", category="Summary"
        ),
    log:
        PATHS.log("report_figures"),
    benchmark:
        PATHS.benchmark("report_figures")
    container:
        CONTAINER
    params:
        results=PATHS.results,
        arms=" ".join(f"--arm={arm}" for arm in ARMS),
    shell:
        "python -m align.cli report {params.results} {params.arms} --figures > {log} 2>&1"
