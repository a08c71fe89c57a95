"""`python -m meshrun.tools.comm` is `meshrun-comm`; its ranks skip a package's __main__ when
multiprocessing starts them (see meshrun/entrypoints.py), so they do not import the driver."""

from meshrun.tools.comm.main import main

main()
