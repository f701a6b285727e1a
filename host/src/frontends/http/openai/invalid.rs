//! A request error that names the request field at fault (OpenAI's `param`): what every
//! step of reading an OpenAI request returns, so that no step depends on another for it.

use crate::error::Error;

/// A request error with the field it is about (OpenAI's `param`).
#[derive(Debug)]
pub struct Invalid {
    /// What went wrong.
    pub error: Error,
    /// The request field, if one is at fault.
    pub param: Option<String>,
}

impl Invalid {
    /// An invalid value of request field `param`.
    pub(super) fn field(param: &str, message: String) -> Self {
        Self {
            error: Error::invalid(message),
            param: Some(param.to_owned()),
        }
    }
}

impl AsRef<Error> for Invalid {
    fn as_ref(&self) -> &Error {
        &self.error
    }
}

impl From<Error> for Invalid {
    fn from(error: Error) -> Self {
        Self { error, param: None }
    }
}
