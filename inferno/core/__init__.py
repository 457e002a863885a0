"""The bottom layer: plain data that crosses layers (a step's schedule and its results, KV block identity) and
the small helpers every layer shares. Imports nothing else of inferno but the other bottom modules."""
