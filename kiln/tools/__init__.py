"""The tools on top of the CLI: bench, compare, profile, synth (each a `kiln` command), and the
transformers reference they measure against."""
