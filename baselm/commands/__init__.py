"""What each `base` command does, below the declarations in `baselm/cli.py`: one module per command
(list, run, chat, bench, serve, doctor, perplexity, the store and signing commands), the options
they share (options.py), the model they load (model.py) and how they report a user's mistake (errors.py).
The engine and the distributed package never import this layer."""
