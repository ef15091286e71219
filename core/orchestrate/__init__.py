"""Driver side: what runs in the `verlflow` process (CLI, flow or task), never in a rank."""
