"""A URI as text: whether it carries credentials, and whether it can name a store's root. Read by the blueprint (its
fields and the file it is read from), the store that opens the root, and the checks; stdlib only."""


def carries_credentials(uri: str) -> bool:
    """Whether a URI holds credentials before its path: s3://KEY:SECRET@bucket/..., https://user:pw@host/... A
    bucket name never holds ':' or '@', and a secret may hold '/': for s3 either one before the first '/' counts."""
    if "://" not in uri:
        return False
    scheme, rest = uri.split("://", 1)
    authority = rest.split("/", 1)[0]
    return "@" in authority or (scheme in ("s3", "s3a") and ":" in authority)


def root_problem(uri: str) -> str | None:
    """Why a file:// or s3:// URI cannot be a store's root, or None. Every key is the root + '/' + a safe key, so the
    root itself must name one place: no '.', '..' or empty segment (S3 keeps '..' in a key as text, so a policy on
    `team-a/` passes `team-a/../../team-b/...`, which anything that normalises paths reads as team-b; a filesystem
    climbs out with it). A file:// path is absolute (file://rel/x would be relative to the current folder). A plain
    folder path is no URI: the blueprint resolves it against its file's folder, `..` included, and the folder it
    names is the root."""
    if "://" not in uri:
        return None
    scheme, path = uri.split("://", 1)
    if scheme == "file" and not path.startswith("/"):
        return (f"file://{path} is relative to the current folder; a file:// URI takes an absolute path "
                "(file:///abs/folder), or give a plain folder path (relative to the blueprint's folder)")
    if scheme not in ("file", "s3"):
        return None
    segments = path.removeprefix("/" if scheme == "file" else "").removesuffix("/").split("/")
    if scheme == "s3" and not segments[0]:
        return "an s3:// URI starts with its bucket (s3://bucket/prefix)"
    bad = [s for s in ("..", ".", "") if s in segments]
    if not bad:
        return None
    what = ", ".join("empty ('//')" if s == "" else f"'{s}'" for s in bad)
    return (f"it has {what} segments; every key of the store is this prefix + '/' + a key, so the prefix must name "
            "one place as written (a '..' would climb out of it). Write the prefix you mean without them")
