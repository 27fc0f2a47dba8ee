"""HTTP routes, one module per concern; router.app includes them all."""
