"""The bottom layer: the experiment's schema, config errors, layouts and rank order, hardware
facts. Imported by every other package; imports none of them."""
