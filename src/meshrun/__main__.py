"""`python -m meshrun` (and `torchrun ... -m meshrun`) is the `meshrun` command."""

from meshrun.driver.cli import main

main()
