rule kernel_gate:
    """The triton_fa2 kernel's equivalence gate on the device the arms run on: the receipt
    (keyed by device model and kernel source) that every fa2 stage of the run reads."""
    input:
        source=KERNEL_SOURCE,
    output:
        PATHS.kernel_receipt,
    log:
        PATHS.log("kernel_gate"),
    benchmark:
        PATHS.benchmark("kernel_gate")
    container:
        CONTAINER
    threads: config["threads"]
    resources:
        **placement(kernel_gate_layout),
        mem_mb=default_mem_mb,
        runtime=default_runtime,
    params:
        device=lambda wildcards: kernel_gate_layout(wildcards)[1],
    shell:
        "python -m align.kernels.equivalence --device={params.device} --out={output} > {log} 2>&1"
