"""The workflow's logic that rules/*.smk call: job resources from receipts, Slurm's answers,
and the stage launch command. Snakemake's own state (the config, the attempt, whether a
scheduler runs the jobs, the image) comes in as arguments, so none of it needs Snakemake to
run or to be tested; the .smk files are the glue that passes it.
"""
