import os

# Tests run servers and engine threads beside each other on few cores: OpenMP threads that spin while
# waiting would starve the others (a several-fold slowdown measured on 2 cores). Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
