"""What each `base` command does, below the declarations in `baselm/cli.py`: run, chat's serving,
bench, doctor, perplexity, the store and signing commands, and the distributed launches of serve and bench."""
