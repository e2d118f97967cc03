"""From a Dynamo FX graph to a clean ATen inference graph: autocast state, lowering, names."""
