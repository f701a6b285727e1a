//! How long a prompt a model takes, checked before anything of it reaches the model: its
//! tokenizer stage would otherwise spend a large multiple of the prompt's size in memory before
//! the decoder refused it. A model's configuration sets the bound (`parameters { key:
//! "max_prompt_chars" value: { string_value: "…" } }`) on each prompt, each message and a
//! chat's messages together; a longer one is a 400 naming the field and the bound.

use crate::{error::Error, proto::inference::ModelConfig};

use super::invalid::Invalid;

/// The configuration parameter that sets the bound.
pub const PARAMETER: &str = "max_prompt_chars";

/// The bound when the configuration sets none: 256 Ki characters, far past the context of any
/// model served here (about 64 Ki tokens of English), and a tokenizer stage's memory for it
/// stays in tens of MiB.
pub const DEFAULT: usize = 256 << 10;

/// A model's bound on prompt characters.
pub fn of(config: &ModelConfig) -> Result<usize, Invalid> {
    match config.parameters.get(PARAMETER) {
        None => Ok(DEFAULT),
        Some(p) => p
            .string_value
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "model '{}': parameter '{PARAMETER}' must be a positive number of \
                     characters, got \"{}\"",
                    config.name, p.string_value
                ))
                .into()
            }),
    }
}

/// Characters counted against the bound, so far.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimit<'a> {
    model: &'a str,
    bound: usize,
    used: usize,
}

impl<'a> PromptLimit<'a> {
    /// The bound of `model`'s configuration.
    pub fn new(config: &'a ModelConfig) -> Result<Self, Invalid> {
        Ok(Self {
            model: &config.name,
            bound: of(config)?,
            used: 0,
        })
    }

    /// Counts `text`, the request's `what` (`messages[2].content`), which `param` carries:
    /// refused when it, or everything counted so far with it, is over the bound.
    pub fn count(&mut self, param: &str, what: &str, text: &str) -> Result<(), Invalid> {
        let chars = text.chars().count();
        self.used = self.used.saturating_add(chars);
        if chars > self.bound || self.used > self.bound {
            let held = if chars > self.bound {
                format!("'{what}' holds {chars} characters")
            } else {
                format!("the prompt holds {} characters with '{what}'", self.used)
            };
            return Err(Invalid::field(
                param,
                format!(
                    "{held}; model '{}' takes prompts of at most {} characters (its parameter \
                     '{PARAMETER}')",
                    self.model, self.bound
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(bound: Option<&str>) -> ModelConfig {
        let mut config = ModelConfig {
            name: "m".into(),
            ..Default::default()
        };
        if let Some(b) = bound {
            config.parameters.insert(
                PARAMETER.into(),
                crate::proto::inference::ModelParameter {
                    string_value: b.into(),
                },
            );
        }
        config
    }

    #[test]
    fn prompts_over_the_bound_are_refused_naming_the_field() {
        let config = config(Some("10"));
        let mut limit = PromptLimit::new(&config).unwrap();
        limit
            .count("messages", "messages[0].content", "héllo")
            .unwrap();
        let e = limit
            .count("messages", "messages[1].content", "world!")
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(
            e.error.message.contains("11 characters"),
            "{}",
            e.error.message
        );
        let e = PromptLimit::new(&config)
            .unwrap()
            .count("instructions", "instructions", &"x".repeat(11))
            .unwrap_err();
        assert!(e.error.message.contains("'instructions' holds 11"));
        assert!(e.error.message.contains("max_prompt_chars"));
    }

    #[test]
    fn the_bound_defaults_and_must_be_a_positive_number() {
        assert_eq!(of(&config(None)).unwrap(), DEFAULT);
        assert!(of(&config(Some("0"))).is_err());
        assert!(of(&config(Some("lots"))).is_err());
    }
}
