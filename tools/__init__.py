"""Release tooling run from a clone (`make base-image`, `make image`, `make image-test`), not shipped in
the wheel: `image_build` builds the trainer image, `image_check` checks it from inside."""
