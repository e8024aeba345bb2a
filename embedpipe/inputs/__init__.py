"""The user's inputs: streaming FASTA reading (``fasta``) and what a sequence may hold and how it
is normalised (``residue_rules``)."""
