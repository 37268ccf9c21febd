//! Summarisers for built-in compaction: the configured model, or — with
//! the offline provider — a deterministic extractive summariser that fills
//! the same five safeguard headings from the text.

use std::sync::Arc;

use async_trait::async_trait;
use ctxgate_proto::pb::{AgentMessage, ContentPart, Role, content_part::Part};
use tokio_util::sync::CancellationToken;

use crate::provider::{ChatRequest, ModelError, ModelProvider, message_text};

pub use ctxgate_proto::extractive::{
    FILES_MODIFIED, FILES_READ, HEADINGS, SUMMARY_CAP, cap, extractive, identifiers, role_name,
};

/// One summarisation step: fold `messages` into `previous`.
#[derive(Debug, Clone, Default)]
pub struct SummaryRequest {
    pub previous: Option<String>,
    pub messages: Vec<AgentMessage>,
    pub instructions: Option<String>,
    /// Why the last attempt failed the audit (on a regeneration).
    pub feedback: Option<String>,
}

#[async_trait]
pub trait Summarizer: Send + Sync {
    async fn summarize(&self, req: SummaryRequest, cancel: &CancellationToken) -> Result<String, ModelError>;
}

/// Summaries from the configured model.
pub struct ModelSummarizer {
    pub provider: Arc<dyn ModelProvider>,
    pub max_tokens: u64,
}

const SYSTEM: &str = "You compact the history of an AI agent's conversation into a summary the agent continues from. \
Write Markdown with exactly these sections, in this order: ## Decisions, ## Open TODOs, ## Constraints/Rules, \
## Pending user asks, ## Exact identifiers (and ## Files read / ## Files modified when files were touched). \
Copy identifiers (paths, ids, names, numbers, URLs) exactly. Keep the latest unresolved user request verbatim \
under Pending user asks. Fold the previous summary in: keep what still matters. Answer with the summary only.";

#[async_trait]
impl Summarizer for ModelSummarizer {
    async fn summarize(&self, req: SummaryRequest, cancel: &CancellationToken) -> Result<String, ModelError> {
        let mut prompt = String::new();
        if let Some(p) = &req.previous {
            prompt.push_str(&format!("<previous-summary>\n{p}\n</previous-summary>\n"));
        }
        prompt.push_str("<conversation>\n");
        for m in &req.messages {
            prompt.push_str(&format!("{}: {}\n", role_name(m.role), message_text(m)));
        }
        prompt.push_str("</conversation>\n");
        if let Some(i) = &req.instructions {
            prompt.push_str(&format!("Additional instructions: {i}\n"));
        }
        if let Some(f) = &req.feedback {
            prompt.push_str(&format!("Your previous attempt was rejected: {f}. Fix that.\n"));
        }
        let message = AgentMessage {
            id: "summary-request".into(),
            role: Role::User as i32,
            content: vec![ContentPart { part: Some(Part::Text(prompt)) }],
            ..Default::default()
        };
        let req = ChatRequest {
            system: Some(SYSTEM.into()),
            messages: vec![message].into(),
            max_tokens: self.max_tokens,
            tools: Vec::new(),
        };
        Ok(self.provider.complete(req, None, cancel).await?.text)
    }
}

/// The deterministic summariser: same input, same summary.
pub struct Extractive;

#[async_trait]
impl Summarizer for Extractive {
    async fn summarize(&self, req: SummaryRequest, _cancel: &CancellationToken) -> Result<String, ModelError> {
        Ok(extractive(req.previous.as_deref(), &req.messages))
    }
}
