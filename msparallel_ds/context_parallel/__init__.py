"""Context-parallel attention: all-gather (colossalai_cp), ring, Ulysses and hybrid Ulysses+ring."""
