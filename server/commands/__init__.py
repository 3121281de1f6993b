"""The command line: flags -> ServerArgs (cli_args.py), `tierlm serve` (serve.py), `tierlm doctor` (doctor.py) and
`tierlm bench` (bench/)."""
