"""FFN's second pass: agglomeration of split segments, split consensus, the fill of what the first
pass left unsegmented."""
