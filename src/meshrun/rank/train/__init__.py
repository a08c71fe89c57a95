"""Training: data split over ranks, optimizer, and the loop."""
