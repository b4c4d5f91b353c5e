"""The snapshot format: the typed, versioned manifest and its JSON form (manifest), its entries and names
(entries), their strict decoding (decode, columns), the dtypes it stores (dtypes), nested state as a JSON tree plus
named tensors (tree), which steps a tier holds committed (committed), and a garbage-collector guard for building
or parsing large manifests (collector). No pickle anywhere.

May import: plan, errors (never a tier's I/O beyond committed's listing through the Backend interface).
"""
