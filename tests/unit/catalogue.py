"""Catalogue products and a start time shared by the pure-core tests (real data shapes,
taken from the sample generator's catalogue)."""

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z

HEADPHONES = {
    "product_id": "sku-737145",
    "title": "Sonique Studio Pro Wireless Noise-Cancelling Over-Ear Headphones, Midnight Black",
    "category": "Electronics > Audio > Headphones",
    "brand": "Sonique",
    "price": 108.99,
}
EARBUDS = {
    "product_id": "sku-149048",
    "title": "Auralis Studio Pro Sport Earbuds, IPX5 Sweatproof, Sand",
    "category": "Electronics > Audio > Headphones",
    "brand": "Auralis",
    "price": 299.99,
}
