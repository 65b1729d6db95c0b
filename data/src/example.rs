//! One question with its reference answers.

use serde::Serialize;

use crate::error::RowProblem;

/// A question with its reference answers, checked on construction: the question is not
/// blank and there is at least one answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Example {
    id: String,
    data_source: String,
    question: String,
    answers: Vec<String>,
}

impl Example {
    /// Builds an example; the question is kept as given (not trimmed).
    pub fn new(
        id: impl Into<String>,
        data_source: impl Into<String>,
        question: impl Into<String>,
        answers: Vec<String>,
    ) -> Result<Self, RowProblem> {
        let question = question.into();
        if question.trim().is_empty() {
            return Err(RowProblem::EmptyQuestion);
        }
        if answers.is_empty() {
            return Err(RowProblem::NoAnswers);
        }
        Ok(Self {
            id: id.into(),
            data_source: data_source.into(),
            question,
            answers,
        })
    }

    /// The row's id (`<file stem>-<row index from 0>` when the file has none).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Which dataset the row comes from (metrics are grouped by it).
    pub fn data_source(&self) -> &str {
        &self.data_source
    }

    /// The raw question, without the `Question: ` prefix or the agent instruction.
    pub fn question(&self) -> &str {
        &self.question
    }

    /// The reference answers (at least one).
    pub fn answers(&self) -> &[String] {
        &self.answers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_blank_question_and_missing_answers() {
        assert_eq!(
            Example::new("i", "s", " \n", vec!["a".into()]),
            Err(RowProblem::EmptyQuestion)
        );
        assert_eq!(
            Example::new("i", "s", "q", vec![]),
            Err(RowProblem::NoAnswers)
        );
        let e = Example::new("i", "s", " q ", vec!["a".into()]).unwrap();
        assert_eq!((e.id(), e.data_source(), e.question()), ("i", "s", " q "));
        assert_eq!(e.answers(), ["a".to_string()]);
    }
}
