"""Model families. Each is a module of pure functions over a params pytree."""
