"""Integrations with serving engines, each imported only when used:
`jax_kvxfer.integrations.easydel` (EasyDeL's eSurge)."""
