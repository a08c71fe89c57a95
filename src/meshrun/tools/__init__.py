"""The commands beside `meshrun`: plan, verify, report, comm, doctor. Each goes through the
driver's compose, resolve and launch path rather than a copy of it."""
