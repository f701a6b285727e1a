//! Reading OpenAI request bodies straight from their bytes, so that a request's memory stays
//! within a small multiple of its body: no intermediate `serde_json::Value` of the whole body,
//! and the fields whose JSON takes several shapes (a prompt, an embedding input, a stop list, a
//! message's content) read element by element, keeping at most what the endpoint accepts and
//! only counting the rest (an untagged serde enum would buffer the whole field first, at tens
//! of times its size).
//!
//! A body is read twice: [`head`] walks it without keeping anything but its field names and
//! `model`, so that unknown fields and unknown models are refused before anything large is
//! decoded; [`read`] then decodes it into the endpoint's wire type.

use std::fmt;

use serde::de::{self, DeserializeOwned, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::invalid::Invalid;
use crate::error::Error;

/// The most fields a body may have (every endpoint takes fewer than this).
const MAX_FIELDS: usize = 64;

/// The most elements a list field keeps; the rest are counted, so that the refusal can say
/// how many there were. Every list an endpoint takes is shorter.
pub const LIST_KEPT: usize = 4096;

/// The most token ids one list keeps (longer than any model's context: the model refuses a
/// prompt past its own).
pub const MAX_TOKEN_IDS: usize = 1 << 20;

/// A body's field names and its `model`, read without decoding anything else.
#[derive(Debug, Default)]
pub struct Head {
    /// The fields, in order.
    pub fields: Vec<String>,
    /// `model`, when it is a string.
    pub model: Option<String>,
}

/// Walks a body (a JSON object) for its field names and `model`.
pub fn head(body: &[u8]) -> Result<Head, Invalid> {
    struct HeadVisitor;
    impl<'de> Visitor<'de> for HeadVisitor {
        type Value = Head;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
            let mut head = Head::default();
            while let Some(key) = map.next_key::<String>()? {
                if head.fields.len() == MAX_FIELDS {
                    return Err(de::Error::custom(format!(
                        "the request body has more than {MAX_FIELDS} fields"
                    )));
                }
                if key == "model" {
                    head.model = map.next_value::<Option<ModelName>>()?.and_then(|m| m.0);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
                head.fields.push(key);
            }
            Ok(head)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let head = de
        .deserialize_map(HeadVisitor)
        .and_then(|h| de.end().map(|()| h))
        .map_err(|e| match e.classify() {
            serde_json::error::Category::Data => {
                Error::invalid(format!("the request body must be a JSON object: {e}"))
            }
            _ => Error::invalid(format!("the request body is not valid JSON: {e}")),
        })?;
    Ok(head)
}

/// `model` as a string, or nothing when it is another type (the typed read names the fault).
struct ModelName(Option<String>);

impl<'de> serde::Deserialize<'de> for ModelName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ModelName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a model name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ModelName, E> {
                Ok(ModelName(Some(v.to_owned())))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<ModelName, E> {
                Ok(ModelName(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<ModelName, E> {
                Ok(ModelName(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<ModelName, E> {
                Ok(ModelName(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<ModelName, E> {
                Ok(ModelName(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ModelName, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ModelName(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ModelName, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ModelName(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// Reads a body into a wire type; a value of the wrong type is refused naming its field.
pub fn read<T: DeserializeOwned>(body: &[u8]) -> Result<T, Invalid> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let param = match e.path().iter().next() {
            Some(serde_path_to_error::Segment::Map { key }) => Some(key.clone()),
            _ => None,
        };
        Invalid {
            error: Error::invalid(format!("'{path}': {}", e.inner())),
            param,
        }
    })
}

/// A list read element by element: at most `MAX` elements kept, the others counted.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed<T, const MAX: usize = LIST_KEPT> {
    /// The first elements, at most `MAX`.
    pub kept: Vec<T>,
    /// How many the list held.
    pub total: usize,
}

impl<T, const MAX: usize> Listed<T, MAX> {
    /// The whole list, when it held at most `MAX` elements.
    pub fn whole(self) -> Option<Vec<T>> {
        (self.total == self.kept.len()).then_some(self.kept)
    }
}

/// Reads the rest of a list after its first `kept` elements: keeps up to `MAX`, counts the
/// others.
pub(super) fn read_listed<'de, A, T, const MAX: usize>(
    mut seq: A,
    mut kept: Vec<T>,
) -> Result<Listed<T, MAX>, A::Error>
where
    A: SeqAccess<'de>,
    T: serde::Deserialize<'de>,
{
    let mut total = kept.len();
    while kept.len() < MAX {
        match seq.next_element::<T>()? {
            Some(item) => {
                kept.push(item);
                total += 1;
            }
            None => return Ok(Listed { kept, total }),
        }
    }
    while seq.next_element::<IgnoredAny>()?.is_some() {
        total += 1;
    }
    Ok(Listed { kept, total })
}

impl<'de, T: serde::Deserialize<'de>, const MAX: usize> serde::Deserialize<'de> for Listed<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T, const MAX: usize>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>, const MAX: usize> Visitor<'de> for V<T, MAX> {
            type Value = Listed<T, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                read_listed(seq, Vec::new())
            }
        }
        d.deserialize_seq(V::<T, MAX>(std::marker::PhantomData))
    }
}

/// What a JSON value of an unexpected shape was, for messages ("got a number", …): the value
/// itself when it is a scalar, its kind when it is a list or an object (which is not kept).
#[derive(Debug, Clone, PartialEq)]
pub struct Shape(pub String);

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Token ids read from a list: the ids, or the first element that is not one.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenIds {
    /// Whole numbers from 0 to 2^31 - 1 (the model checks its vocabulary).
    Ids(Vec<i32>),
    /// The first element that is not a token id: its index and what it was.
    Bad(usize, Shape),
    /// More than [`MAX_TOKEN_IDS`]: how many.
    TooMany(usize),
}

impl TokenIds {
    fn read<'de, A: SeqAccess<'de>>(mut seq: A, mut ids: Vec<i32>) -> Result<Self, A::Error> {
        while let Some(e) = seq.next_element::<Element>()? {
            match e.token_id() {
                Some(_) if ids.len() == MAX_TOKEN_IDS => {
                    let mut total = ids.len() + 1;
                    while seq.next_element::<IgnoredAny>()?.is_some() {
                        total += 1;
                    }
                    return Ok(TokenIds::TooMany(total));
                }
                Some(id) => ids.push(id),
                None => {
                    let at = ids.len();
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(TokenIds::Bad(at, e.shape()));
                }
            }
        }
        Ok(TokenIds::Ids(ids))
    }
}

impl<'de> serde::Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Element::deserialize(d)? {
            Element::Ids(ids) => Ok(ids),
            other => Ok(TokenIds::Bad(0, other.shape())),
        }
    }
}

/// One element of a list whose elements may take several shapes, read without buffering.
#[derive(Debug)]
pub(super) enum Element {
    Text(String),
    Int(i64),
    Uint(u64),
    Float(f64),
    Bool(bool),
    Null,
    /// A list: read as token ids (a token-id list is the only list inside the lists taken).
    Ids(TokenIds),
    Object,
}

impl Element {
    fn token_id(&self) -> Option<i32> {
        match self {
            Element::Int(i) => i32::try_from(*i).ok().filter(|i| *i >= 0),
            Element::Uint(u) => i32::try_from(*u).ok(),
            _ => None,
        }
    }

    pub(super) fn shape(&self) -> Shape {
        Shape(match self {
            Element::Text(s) => serde_json::Value::String(s.clone()).to_string(),
            Element::Int(i) => i.to_string(),
            Element::Uint(u) => u.to_string(),
            Element::Float(f) => serde_json::Value::from(*f).to_string(),
            Element::Bool(b) => b.to_string(),
            Element::Null => "null".into(),
            Element::Ids(_) => "a list".into(),
            Element::Object => "an object".into(),
        })
    }
}

impl<'de> serde::Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Element;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Element, E> {
                Ok(Element::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Element, E> {
                Ok(Element::Text(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Element, E> {
                Ok(Element::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Element, E> {
                Ok(Element::Uint(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Element, E> {
                Ok(Element::Float(v))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Element, E> {
                Ok(Element::Bool(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Element, E> {
                Ok(Element::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Element, A::Error> {
                TokenIds::read(seq, Vec::new()).map(Element::Ids)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Element, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Element::Object)
            }
        }
        d.deserialize_any(V)
    }
}

/// A field that is one text, a list of texts, token ids or a list of token-id lists (a
/// completion's `prompt`, an embedding request's `input`), read without buffering.
#[derive(Debug, Clone, PartialEq)]
pub enum TextsOrIds {
    /// One text.
    Text(String),
    /// A list of texts.
    Texts(Listed<String>),
    /// A list of token ids.
    Ids(TokenIds),
    /// A list of token-id lists.
    IdLists(Listed<TokenIds>),
    /// A list whose element `at` is not of the list's kind (its first element's, `expected`).
    Mixed {
        /// The element's index.
        at: usize,
        /// What it was.
        found: Shape,
        /// What the list's elements are.
        expected: &'static str,
    },
    /// Anything else.
    Other(Shape),
}

impl<'de> serde::Deserialize<'de> for TextsOrIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextsOrIds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of strings or token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Text(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Other(Element::Int(v).shape()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Other(Element::Uint(v).shape()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Other(Element::Float(v).shape()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Other(Element::Bool(v).shape()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<TextsOrIds, E> {
                Ok(TextsOrIds::Other(Element::Null.shape()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextsOrIds, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(TextsOrIds::Other(Element::Object.shape()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextsOrIds, A::Error> {
                // The first element says which kind of list this is.
                let Some(first) = seq.next_element::<Element>()? else {
                    return Ok(TextsOrIds::Texts(Listed {
                        kept: Vec::new(),
                        total: 0,
                    }));
                };
                let mixed = |seq: &mut A, at: usize, e: &Element, expected| {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(TextsOrIds::Mixed {
                        at,
                        found: e.shape(),
                        expected,
                    })
                };
                match first {
                    Element::Text(text) => {
                        // Strings to the end; another kind of element is refused by index.
                        let mut kept = vec![text];
                        let mut total = 1;
                        while let Some(e) = seq.next_element::<Element>()? {
                            match e {
                                Element::Text(t) if kept.len() < LIST_KEPT => kept.push(t),
                                Element::Text(_) => {}
                                other => return mixed(&mut seq, total, &other, "a string"),
                            }
                            total += 1;
                        }
                        Ok(TextsOrIds::Texts(Listed { kept, total }))
                    }
                    Element::Ids(ids) => {
                        let mut kept = vec![ids];
                        let mut total = 1;
                        while let Some(e) = seq.next_element::<Element>()? {
                            match e {
                                Element::Ids(ids) if kept.len() < LIST_KEPT => kept.push(ids),
                                Element::Ids(_) => {}
                                other => {
                                    return mixed(&mut seq, total, &other, "a list of token ids")
                                }
                            }
                            total += 1;
                        }
                        Ok(TextsOrIds::IdLists(Listed { kept, total }))
                    }
                    first => match first.token_id() {
                        Some(id) => Ok(TextsOrIds::Ids(TokenIds::read(seq, vec![id])?)),
                        None => {
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            Ok(TextsOrIds::Ids(TokenIds::Bad(0, first.shape())))
                        }
                    },
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A field that is one string or a list of strings (`stop`), read without buffering.
#[derive(Debug, Clone, PartialEq)]
pub enum StringOrList {
    /// One string.
    One(String),
    /// A list of strings.
    Many(Listed<String>),
    /// Anything else, or a list holding something else.
    Other(Shape),
}

impl<'de> serde::Deserialize<'de> for StringOrList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match TextsOrIds::deserialize(d)? {
            TextsOrIds::Text(s) => StringOrList::One(s),
            TextsOrIds::Texts(list) => StringOrList::Many(list),
            TextsOrIds::Mixed { .. } | TextsOrIds::Ids(_) | TextsOrIds::IdLists(_) => {
                StringOrList::Other(Shape("a list holding something other than strings".into()))
            }
            TextsOrIds::Other(shape) => StringOrList::Other(shape),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse<T: DeserializeOwned>(json: &str) -> T {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn prompts_of_every_shape_are_read_without_buffering() {
        assert_eq!(
            parse::<TextsOrIds>(r#""hi""#),
            TextsOrIds::Text("hi".into())
        );
        let TextsOrIds::Texts(t) = parse(r#"["a", "b"]"#) else {
            panic!()
        };
        assert_eq!(t.whole().unwrap(), ["a", "b"]);
        assert_eq!(
            parse::<TextsOrIds>("[1, 2, 3]"),
            TextsOrIds::Ids(TokenIds::Ids(vec![1, 2, 3]))
        );
        let TextsOrIds::IdLists(l) = parse("[[1], [2, 3]]") else {
            panic!()
        };
        assert_eq!(l.kept[1], TokenIds::Ids(vec![2, 3]));
        assert_eq!(
            parse::<TextsOrIds>("[1, -2, 3]"),
            TextsOrIds::Ids(TokenIds::Bad(1, Shape("-2".into())))
        );
        assert_eq!(
            parse::<TextsOrIds>("[1.5]"),
            TextsOrIds::Ids(TokenIds::Bad(0, Shape("1.5".into())))
        );
        assert_eq!(
            parse::<TextsOrIds>(r#"["a", 1]"#),
            TextsOrIds::Mixed {
                at: 1,
                found: Shape("1".into()),
                expected: "a string"
            }
        );
        assert_eq!(
            parse::<TextsOrIds>(r#"{"a": [1, 2]}"#),
            TextsOrIds::Other(Shape("an object".into()))
        );
    }

    #[test]
    fn long_lists_keep_their_head_and_count_the_rest() {
        let json = serde_json::to_string(&vec!["x"; LIST_KEPT + 10]).unwrap();
        let TextsOrIds::Texts(t) = parse(&json) else {
            panic!()
        };
        assert_eq!((t.kept.len(), t.total), (LIST_KEPT, LIST_KEPT + 10));
        assert!(t.whole().is_none());
        let small: Listed<u8, 2> = parse("[1, 2, 3, 4]");
        assert_eq!((small.kept, small.total), (vec![1, 2], 4));
    }

    #[test]
    fn the_head_holds_field_names_and_the_model() {
        let h = head(br#"{"model": "m", "prompt": [1, 2, {"x": [3]}], "n": 2}"#).unwrap();
        assert_eq!(h.fields, ["model", "prompt", "n"]);
        assert_eq!(h.model.as_deref(), Some("m"));
        assert!(head(b"[1]").is_err());
        assert!(head(b"{").is_err());
        let many: String = (0..MAX_FIELDS + 1)
            .map(|i| format!("\"f{i}\": 1"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(head(format!("{{{many}}}").as_bytes()).is_err());
    }
}
