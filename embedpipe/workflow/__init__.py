"""What the Snakemake workflow needs from the package: the config coerced to the schema's types
(``config``) and the checks the rules make before a job starts (``checks``)."""
