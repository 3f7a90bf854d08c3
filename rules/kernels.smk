rule kernel_gate:
    """A gated attention backend's equivalence gate on the device the arms run it on: the
    receipt (keyed by device model and source) that every stage running it reads."""
    input:
        source=kernel_gate_source,
    output:
        PATHS.kernel_receipt(KERNEL_GATE_WILDCARD),
    log:
        PATHS.log("kernel_gate", "{backend}"),
    benchmark:
        PATHS.benchmark("kernel_gate", "{backend}")
    container:
        CONTAINER
    threads: config["threads"]
    resources:
        **placement(kernel_gate_layout),
        mem_mb=default_mem_mb,
        runtime=default_runtime,
    params:
        device=lambda wildcards: kernel_gate_layout(wildcards)[1],
        module=lambda wildcards: GATED_ATTENTION[wildcards.backend][0],
    shell:
        "python -m {params.module} --device={params.device} --out={output} > {log} 2>&1"
