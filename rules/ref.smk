rule ref_cache:
    """Reference log-probs of every pair through one forward path, keyed by six components.

    The arm's ranks score disjoint slices; finished slices persist next to the outputs
    (<cache>.parts/), so a rerun after a kill computes only what is missing.
    """
    input:
        script=SCRIPTS / "precompute_ref_logprobs.py",
        gate=PATHS.sft_gate,
        manifest=PATHS.manifest,
        shards=lambda w: list(arm_shards(w.arm).values()),
        config=lambda w: arm_toml(w.arm),
        kernel=kernel_receipts,
    output:
        train=ANY_ARM.ref_cache("{forward_impl}", "train"),
        held=ANY_ARM.ref_cache("{forward_impl}", "held"),
        receipt=ANY_ARM.ref_receipt("{forward_impl}"),
    log:
        PATHS.log("ref_cache", "{arm}-{forward_impl}"),
    benchmark:
        PATHS.benchmark("ref_cache", "{arm}-{forward_impl}")
    container:
        container_for(arm_layout)
    threads: config["threads"]
    resources:
        **placement(arm_layout),
        mem_mb=projected_mem_mb(
            "ref_cache",
            arm_cfg_of,
            arm_layout,
            sft_checkpoint(),
            lambda w: arm_shards(w.arm),
        ),
        runtime=default_runtime,
        stop_window_s=unmeasured_stop_window_s,
    params:
        run=RUN_OVERRIDES,
        ref=ref_overrides,
        launch=launcher(arm_layout),
        rank_threads=layout_rank_threads(arm_layout),
    shell:
        "exec {params.launch} {input.script} {input.config}"
        " {params.run} --run.threads={params.rank_threads} {params.ref} > {log} 2>&1"


checkpoint path_bias:
    """Step-0 mismatch of the training forward path vs the cache: accept, or recompute."""
    input:
        script=SCRIPTS / "precompute_ref_logprobs.py",
        caches=preregistered_ref_caches,
        config=lambda w: arm_toml(w.arm),
        kernel=kernel_receipts,
    output:
        ANY_ARM.path_bias,
    log:
        PATHS.log("path_bias", "{arm}"),
    benchmark:
        PATHS.benchmark("path_bias", "{arm}")
    container:
        container_for(arm_layout)
    threads: config["threads"]
    resources:
        **placement(arm_layout),
        mem_mb=projected_mem_mb(
            "path_bias",
            arm_cfg_of,
            arm_layout,
            sft_checkpoint(),
            lambda w: arm_shards(w.arm),
        ),
        runtime=default_runtime,
        stop_window_s=unmeasured_stop_window_s,
    params:
        run=RUN_OVERRIDES,
        launch=launcher(arm_layout),
        rank_threads=layout_rank_threads(arm_layout),
    shell:
        "exec {params.launch} {input.script} {input.config} --path-bias"
        " {params.run} --run.threads={params.rank_threads} > {log} 2>&1"
