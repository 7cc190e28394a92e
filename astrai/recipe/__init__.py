"""Recipes: named stages chained by reference, each fingerprinted, skipped when up to date.

Modules: `spec` (stage specs and reference resolution, located errors), `fingerprint` (what makes a
stage's output current), `rundir` (the run directory layout), `runner` (run/skip/resume, summary),
`table` (the end-of-run table), `plot` (loss-curve PNG without dependencies), `tokenizer` (the
tokenizer stage: byte-level BPE trained on the recipe's own records).
"""
