//! Which models a permission covers: exact names, prefixes written `name*`, or `*`.

/// Model names a permission covers: exact names, prefixes written `name*`, or `*` for all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelPatterns(Vec<String>);

impl ModelPatterns {
    pub(super) fn new(patterns: Vec<String>, field: &str) -> std::result::Result<Self, String> {
        for p in &patterns {
            let body = p.strip_suffix('*').unwrap_or(p);
            if p.is_empty() || body.contains('*') {
                return Err(format!(
                    "{field}: \"{p}\" is not a model name or a prefix ending in a single *"
                ));
            }
        }
        Ok(Self(patterns))
    }

    /// Whether `model` is covered.
    pub fn matches(&self, model: &str) -> bool {
        self.0.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => p == model,
        })
    }
}
