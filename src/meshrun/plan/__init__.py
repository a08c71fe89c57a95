"""Predictions before launch: memory per rank (memory.py), step time (speed.py), every legal
layout ranked by them (search.py), uneven pipeline splits for mixed boxes (split.py)."""
