rule tiny_default:
    """Write the embedded tiny default: seeded data, tokenizer, random base model."""
    input:
        script=SCRIPTS / "tiny_default.py",
        config=TINY_TOML,
    output:
        data=[
            TINY_DIR / "data" / f"{name}.jsonl"
            for name in ("argilla", "steppairs", "sft")
        ],
        base=[TINY_DIR / "base" / name for name in CHECKPOINT_FILES],
        receipt=TINY_DIR / "receipt.json",
    log:
        PATHS.log("tiny_default"),
    benchmark:
        PATHS.benchmark("tiny_default")
    container:
        CONTAINER
    resources:
        **placement(cpu_layout),
        mem_mb=default_mem_mb,
        runtime=default_runtime,
    params:
        out_dir=TINY_DIR,
    shell:
        "python {input.script} {input.config} --out_dir={params.out_dir} > {log} 2>&1"
