//! Whisper's languages by code, with the names OpenAI's API answers in
//! (`verbose_json`'s `language` is `english`, not `en`).

/// (code, name) of every language Whisper knows, in its token order.
const LANGUAGES: &[(&str, &str)] = &[
    ("en", "english"),
    ("zh", "chinese"),
    ("de", "german"),
    ("es", "spanish"),
    ("ru", "russian"),
    ("ko", "korean"),
    ("fr", "french"),
    ("ja", "japanese"),
    ("pt", "portuguese"),
    ("tr", "turkish"),
    ("pl", "polish"),
    ("ca", "catalan"),
    ("nl", "dutch"),
    ("ar", "arabic"),
    ("sv", "swedish"),
    ("it", "italian"),
    ("id", "indonesian"),
    ("hi", "hindi"),
    ("fi", "finnish"),
    ("vi", "vietnamese"),
    ("he", "hebrew"),
    ("uk", "ukrainian"),
    ("el", "greek"),
    ("ms", "malay"),
    ("cs", "czech"),
    ("ro", "romanian"),
    ("da", "danish"),
    ("hu", "hungarian"),
    ("ta", "tamil"),
    ("no", "norwegian"),
    ("th", "thai"),
    ("ur", "urdu"),
    ("hr", "croatian"),
    ("bg", "bulgarian"),
    ("lt", "lithuanian"),
    ("la", "latin"),
    ("mi", "maori"),
    ("ml", "malayalam"),
    ("cy", "welsh"),
    ("sk", "slovak"),
    ("te", "telugu"),
    ("fa", "persian"),
    ("lv", "latvian"),
    ("bn", "bengali"),
    ("sr", "serbian"),
    ("az", "azerbaijani"),
    ("sl", "slovenian"),
    ("kn", "kannada"),
    ("et", "estonian"),
    ("mk", "macedonian"),
    ("br", "breton"),
    ("eu", "basque"),
    ("is", "icelandic"),
    ("hy", "armenian"),
    ("ne", "nepali"),
    ("mn", "mongolian"),
    ("bs", "bosnian"),
    ("kk", "kazakh"),
    ("sq", "albanian"),
    ("sw", "swahili"),
    ("gl", "galician"),
    ("mr", "marathi"),
    ("pa", "punjabi"),
    ("si", "sinhala"),
    ("km", "khmer"),
    ("sn", "shona"),
    ("yo", "yoruba"),
    ("so", "somali"),
    ("af", "afrikaans"),
    ("oc", "occitan"),
    ("ka", "georgian"),
    ("be", "belarusian"),
    ("tg", "tajik"),
    ("sd", "sindhi"),
    ("gu", "gujarati"),
    ("am", "amharic"),
    ("yi", "yiddish"),
    ("lo", "lao"),
    ("uz", "uzbek"),
    ("fo", "faroese"),
    ("ht", "haitian creole"),
    ("ps", "pashto"),
    ("tk", "turkmen"),
    ("nn", "nynorsk"),
    ("mt", "maltese"),
    ("sa", "sanskrit"),
    ("lb", "luxembourgish"),
    ("my", "myanmar"),
    ("bo", "tibetan"),
    ("tl", "tagalog"),
    ("mg", "malagasy"),
    ("as", "assamese"),
    ("tt", "tatar"),
    ("haw", "hawaiian"),
    ("ln", "lingala"),
    ("ha", "hausa"),
    ("ba", "bashkir"),
    ("jw", "javanese"),
    ("su", "sundanese"),
    ("yue", "cantonese"),
];

/// The English name of a language code (`en` → `english`); the code itself when unknown.
pub fn name(code: &str) -> &str {
    LANGUAGES.iter().find(|(c, _)| *c == code).map_or(code, |(_, n)| n)
}

/// Other names Whisper takes for its languages (its `TO_LANGUAGE_CODE`), and `jv`, the
/// ISO 639-1 code of Javanese (OpenAI documents ISO 639-1 codes; Whisper says `jw`).
const ALIASES: [(&str, &str); 13] = [
    ("burmese", "my"),
    ("valencian", "ca"),
    ("flemish", "nl"),
    ("haitian", "ht"),
    ("letzeburgesch", "lb"),
    ("pushto", "ps"),
    ("panjabi", "pa"),
    ("moldavian", "ro"),
    ("moldovan", "ro"),
    ("sinhalese", "si"),
    ("castilian", "es"),
    ("mandarin", "zh"),
    ("jv", "jw"),
];

/// The code of a language given by code or by name, as OpenAI's clients send it
/// (`en`, `EN`, `english`, `castilian`); `None` when Whisper does not know it.
pub fn code(given: &str) -> Option<&'static str> {
    let given = given.trim().to_ascii_lowercase();
    let given = ALIASES.iter().find(|(alias, _)| *alias == given).map_or(given.as_str(), |(_, c)| *c);
    LANGUAGES.iter().find(|(c, n)| *c == given || *n == given).map(|(c, _)| *c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_map_both_ways() {
        assert_eq!(name("en"), "english");
        assert_eq!(name("haw"), "hawaiian");
        assert_eq!(name("xx"), "xx");
        assert_eq!(code("EN"), Some("en"));
        assert_eq!(code("german"), Some("de"));
        assert_eq!(code("klingon"), None);
        assert_eq!(code("Castilian"), Some("es"));
        assert_eq!(code("jv"), Some("jw"), "ISO 639-1's Javanese");
        assert_eq!(code("haitian creole"), Some("ht"));
        assert!(ALIASES.iter().all(|(_, c)| LANGUAGES.iter().any(|(l, _)| l == c)));
        assert_eq!(LANGUAGES.len(), 100);
    }
}
