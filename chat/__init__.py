"""bitchat's REPL, built on engine's public generator API (engine/api.py); its command line (the `bitchat`
entry point, model loading, choice of front end) is cli/chat.py.

Modules:
    repl.py        front ends: prompt_toolkit REPL on a terminal, plain line loop on a pipe
    session.py     one chat session: turns, context-window trimming, streaming, Ctrl-C, commands
    splice.py      next-turn prompt ids that extend the exact tokens in the KV cache
    commands.py    slash commands: table, parsing, validation, completion, sampling settings
    transcript.py  the conversation model and its atomic JSON save/load
    render.py      where output goes (stdout/stderr), dim stats line, safe display of model text
"""
