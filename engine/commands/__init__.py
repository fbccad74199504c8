"""One module per `bitnet` subcommand. Each defines HELP (one line), add_arguments(parser) and
main(args) -> exit code. Heavy imports happen inside main(), so `bitnet --help` stays instant."""
