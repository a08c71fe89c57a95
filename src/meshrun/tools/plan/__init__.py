"""`meshrun-plan`: the planner's table (command.py) and `meshrun-plan calibrate`, which
measures this host's rates for it (calibrate.py)."""
