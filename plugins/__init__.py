"""trainbus.plugins: every feature, and the Hugging Face style facade."""
