"""Is this blueprint runnable here? Every check of files, model folders, rewards, data, the engine and memory that
the CLI (`verlflow validate`), the validate flow and the validate stage run. The blueprint describes; it checks
nothing outside itself."""
