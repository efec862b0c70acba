"""The rate-matching controller: sizes the prefill and decode pools from
measured profiles (solver, capacity check), and the live loop that corrects
and applies the decision. The cores (profiles, solver, capacity, loop) do no
I/O; metrics scraping and Kubernetes writes live in their own modules."""
