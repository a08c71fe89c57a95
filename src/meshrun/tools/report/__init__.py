"""`meshrun-report`: compare runs of the results store in the terminal and on one HTML page."""
