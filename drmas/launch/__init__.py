"""Entry points: the `drmas` CLI (cli.py), the typed run config (config.py), and
`drmas train`, which starts and supervises every role on this machine (train.py,
supervisor.py, progress.py)."""
