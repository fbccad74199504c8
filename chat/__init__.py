"""bitchat: the interactive terminal chat, built on engine's public generator API only."""
