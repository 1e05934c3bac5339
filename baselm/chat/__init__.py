"""`base chat`: a terminal REPL over the engine.

The REPL talks to an `AsyncEngine` like any server would: each turn is one request whose
prompt is the whole conversation. The prompt of turn N+1 starts with the token ids of
turn N (its prompt and the answer the model generated), so the engine's prefix cache
finds the conversation's blocks and only the new message is prefilled: the time to
the first token does not grow with the length of the conversation (see `Conversation`).

The modules, in the order a turn uses them:
- `line_reader`: input lines (multi-line messages, readline history);
- `settings`: the sampling settings /set changes, and the options `base chat` starts with;
- `conversation`: the messages, and the prompt ids that extend the last turn;
- `view`: the answer on the terminal as it streams;
- `answer`, `stats`: an answer as it arrives, a turn's and the session's numbers;
- `chat_file`: the JSON file of /save and /load;
- `repl`: the loop, its commands, and the engine it runs on.

`base chat --serve` also serves the HTTP API on the same engine: the CLI composes the two,
so this package does not depend on `baselm.api`.
"""
