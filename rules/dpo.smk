rule preflight:
    """RSS projection of the job for the optimizer it runs, against its node (exit 6)."""
    input:
        script=SCRIPTS / "preflight.py",
        path_bias=ANY_ARM.path_bias,
        caches=caches_in_use,
        config=lambda w: arm_toml(w.arm),
    output:
        ANY_ARM.preflight,
    log:
        PATHS.log("preflight", "{arm}"),
    benchmark:
        PATHS.benchmark("preflight", "{arm}")
    container:
        CONTAINER
    params:
        run=RUN_OVERRIDES,
        node=node_memory_overrides,
    shell:
        "python {input.script} {input.config} {params.run} {params.node} > {log} 2>&1"


rule probe:
    """Real micro-steps on the real topology: step time, tokens/s, peak memory, wall-clock."""
    input:
        script=SCRIPTS / "dpo.py",
        preflight=ANY_ARM.preflight,
        caches=caches_in_use,
        config=lambda w: arm_toml(w.arm),
        kernel=kernel_receipts,
    output:
        ANY_ARM.probe,
    log:
        PATHS.log("probe", "{arm}"),
    benchmark:
        PATHS.benchmark("probe", "{arm}")
    container:
        container_for(arm_layout)
    threads: config["threads"]
    resources:
        **placement(arm_layout),
        mem_mb=probe_mem_mb,
        runtime=default_runtime,
        stop_window_s=unmeasured_stop_window_s,
    params:
        run=RUN_OVERRIDES,
        launch=launcher(arm_layout),
        rank_threads=layout_rank_threads(arm_layout),
    shell:
        "exec {params.launch} {input.script} {input.config} --probe"
        " {params.run} --run.threads={params.rank_threads} > {log} 2>&1"


rule dpo:
    """Re-check every gate, train the arm against the cache in use, evaluate held-out."""
    input:
        script=SCRIPTS / "dpo.py",
        probe=ANY_ARM.probe,
        caches=caches_in_use,
        config=lambda w: arm_toml(w.arm),
        kernel=kernel_receipts,
    output:
        ANY_ARM.arm_result,
    log:
        PATHS.log("dpo", "{arm}"),
    benchmark:
        PATHS.benchmark("dpo", "{arm}")
    container:
        container_for(arm_layout)
    threads: config["threads"]
    resources:
        **placement(arm_layout),
        mem_mb=dpo_mem_mb,
        runtime=dpo_runtime,
        trainer_resume=trainer_resume,
        trainer_wall_s=dpo_wall_s,
        stop_window_s=dpo_stop_window_s,
        slurm_extra=pre_timeout_signal(dpo_stop_window_s),
    params:
        run=RUN_OVERRIDES,
        # A tripwire that fired after the rerun (exit 5) leaves a result that selection reads.
        launch=launcher(
            arm_layout, stop_marker=arm_stop_marker, accept_exit=(TRIPWIRE,)
        ),
        rank_threads=layout_rank_threads(arm_layout),
    shell:
        "exec {params.launch} {input.script} {input.config} {params.run}"
        " --run.threads={params.rank_threads} --trainer.resume={resources.trainer_resume}"
        " --trainer.max_wall_seconds={resources.trainer_wall_s} > {log} 2>&1"
