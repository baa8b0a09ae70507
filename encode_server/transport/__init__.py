"""Moving rows between processes over RDMA-capable transfer libraries: Mooncake's TransferEngine
(`mooncake.py`), NIXL with its registered pool of blocks that consumers read (`nixl.py`), the registered
memory such a library may read or write and its bound (`registered.py`), and what each transport has
moved (`stats.py`). Neither library is a dependency of the server (`ops.libraries` says which extra
installs each).

Imports `ops` only: the fronts (`fronts/`) speak the peers' protocols on top of it.
"""
