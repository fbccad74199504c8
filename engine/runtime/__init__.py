"""The runtime over a mapped weight store: the transformer (model), sampling, the streaming generator,
prompt-lookup drafts and chat templates. Reads files only through engine.formats."""
