"""The work of each DAG node, as functions of typed inputs to typed outputs."""
