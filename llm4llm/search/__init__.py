"""Search over candidate kernels for one task: proposers, episodes with restart, distilled experience."""
from llm4llm.search.builtin import LibraryProposer
from llm4llm.search.episode import EpisodeRecord, SearchResult, Trial, run_search
from llm4llm.search.experience import distil
from llm4llm.search.proposer import Proposer
from llm4llm.search.types import Candidate, Experience, Feedback

__all__ = ["Candidate", "EpisodeRecord", "Experience", "Feedback", "LibraryProposer", "Proposer", "SearchResult",
           "Trial", "distil", "run_search"]
