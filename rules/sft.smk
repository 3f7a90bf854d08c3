rule sft:
    """Train the starting policy from the base model (only when no SFT checkpoint is given)."""
    input:
        script=SCRIPTS / "sft.py",
        base=base_model_files,
        data=sft_cfg().data.files,
        config=SFT_TOML,
    output:
        checkpoint=directory(PATHS.sft_checkpoint),
        receipt=PATHS.sft_receipt,
    log:
        PATHS.log("sft"),
    benchmark:
        PATHS.benchmark("sft")
    container:
        container_for(sft_layout)
    threads: config["threads"]
    resources:
        **placement(sft_layout),
        mem_mb=projected_mem_mb("sft", sft_cfg_of, sft_layout, BASE_MODEL),
        runtime=sft_runtime,
        trainer_resume=trainer_resume,
        trainer_wall_s=sft_wall_s,
        stop_window_s=unmeasured_stop_window_s,
        slurm_extra=pre_timeout_signal(unmeasured_stop_window_s),
    params:
        run=RUN_OVERRIDES,
        launch=launcher(sft_layout, stop_marker=lambda w: PATHS.sft_stop_marker),
        rank_threads=layout_rank_threads(sft_layout),
    shell:
        "exec {params.launch} {input.script} {input.config} {params.run}"
        " --run.threads={params.rank_threads} --trainer.resume={resources.trainer_resume}"
        " --trainer.max_wall_seconds={resources.trainer_wall_s} > {log} 2>&1"


rule sft_gate:
    """Section-11 quality receipt of the SFT checkpoint: held-out NLL, greedy generations."""
    input:
        script=SCRIPTS / "sft_gate.py",
        checkpoint=sft_checkpoint_files,
        data=sft_cfg().data.files,
        config=SFT_TOML,
    output:
        PATHS.sft_gate,
    log:
        PATHS.log("sft_gate"),
    benchmark:
        PATHS.benchmark("sft_gate")
    container:
        CONTAINER
    threads: config["threads"]
    resources:
        **placement(sft_gate_layout),
        mem_mb=projected_mem_mb(
            "sft_gate", sft_cfg_of, sft_gate_layout, sft_checkpoint()
        ),
        runtime=default_runtime,
    params:
        run=RUN_OVERRIDES,
    shell:
        "python {input.script} {input.config} {params.run} --run.threads={threads} > {log} 2>&1"
