"""Pinned stacks and container images: locks, input hashes, dated tags, pins consistency.

Standard-library only, like the rest of the CI machinery: `config` (stacks and variants from
images.toml), `pins` (locks vs installed packages and Dockerfiles), `lock` (`invoke lock`),
`inputs` (input hash and tags), `plan` (`invoke refresh-image`, `invoke check-image`).
"""
