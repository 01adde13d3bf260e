//! A prepared publication handed from one process of a writer to another (a
//! serving engine's scheduler prepares, its worker stores and publishes):
//! the publication, with the writer's secret token, and its total. Whoever
//! holds the token may store, publish and abort the publication, so it
//! travels only inside one trust domain, never to a reader; the daemon still
//! checks the token and the publication's state on every step.

use serde::{Deserialize, Serialize};

use crate::wire::Prepared;

/// A string that is not a handoff token, and why (the JSON's fault).
#[derive(Debug, thiserror::Error)]
#[error("not a handoff token: {0}")]
pub struct BadToken(pub String);

/// An open publication: prepared, not yet published.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Open {
    /// The publication and its writer token.
    pub prepared: Prepared,
    /// How many chunks it was prepared for.
    pub total_chunks: u32,
}

impl Open {
    /// The token another process resumes from ([`Open::resume`]): JSON,
    /// `{"prepared": …, "total_chunks": n}`.
    pub fn token(&self) -> String {
        // A struct of plain fields always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The open publication a [`token`](Open::token) names, or why `token` is
    /// not one.
    pub fn resume(token: &str) -> Result<Open, BadToken> {
        serde_json::from_str(token).map_err(|e| BadToken(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_resumes_the_publication_it_was_made_from_and_nothing_else_parses() {
        let json =
            r#"{"prepared":{"publication":7,"writer_token":"s3cret","namespace":"ns","epoch":2},"total_chunks":3}"#;
        let open = Open::resume(json).expect("a token");
        assert_eq!((open.prepared.publication, open.total_chunks), (7, 3));
        let again = Open::resume(&open.token()).expect("its own token");
        assert_eq!((again.prepared.writer_token.as_str(), again.total_chunks), ("s3cret", 3));
        assert!(Open::resume(r#"{"total_chunks":3}"#).unwrap_err().0.contains("prepared"));
        assert!(Open::resume("nonsense").is_err());
    }
}
